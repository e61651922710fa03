"""Online speculative decoding (OSD, Liu et al.): the draft keeps learning from served
traffic. The engine records the target's distribution where the draft missed (`record`), a
bounded buffer per domain keeps them (`buffer`), a background process distils the draft's
last layers toward them (`student`, `losses`, `distill`, `worker`) and the new draft is
swapped in between requests after a guard checks it (`service`)."""
