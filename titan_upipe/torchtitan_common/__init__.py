"""What every TorchTitan version the plugin supports shares: code that speaks an API 0.2.2 and 0.3
have alike (``cpu_runtime``: ``torchtitan.tools.utils``'s device globals). Both adapters import it;
it imports neither (``tests/test_layers.py``)."""
