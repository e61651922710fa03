"""Length controllers: how many tokens to draft before verifying."""
