"""Embedded data: a tokenizer and synthetic datasets that need no download."""
