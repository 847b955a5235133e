"""What the command-line tools share, below them all (``plan``'s CLI, ``emulate``, ``validate``,
``check``, the GPU suite): no TorchTitan, no tool of its own.

================  =============================================================================
module            holds
================  =============================================================================
cli_args          ``ToolParser`` (one-line argument errors) and the argparse types of counts,
                  sizes and token lengths
memory_tracker    the live-tensor tracker: bytes of every live tensor, moment by moment (CPU)
packed_documents  packed-document batches of given lengths (the emulator's and the GPU suite's)
================  =============================================================================
"""
