"""Drafters: propose the next tokens cheaply."""
