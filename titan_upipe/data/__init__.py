"""Data without TorchTitan: the embedded tokenizer's files, the synthetic copy and document tasks, local
text corpora and packing (TorchTitan's loaders over them: ``torchtitan_0_2.data_builders``, ``data_loader``)."""
