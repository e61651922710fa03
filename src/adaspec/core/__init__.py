"""The decoding vocabulary every layer shares: proposals and token trees, sampling, metrics
and text assembly. Below everything; imports nothing of adaspec but `errors`."""
