"""Data: the embedded tokenizer and synthetic copy task, local text corpora, and the global-batch loader."""
