"""Decoding methods: the method-string grammar and the registry of what a name selects."""
