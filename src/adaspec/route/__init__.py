"""The context-aware draft router (Huang et al.): a policy trained offline reads the target's
prompt state from the prefill and picks the decoding method (drafter or plain decoding) for
each request. One module per job: arms (the choices), reward (Rouge-L and cost), data (the
offline table), collect (measuring it), policy (MLP + REINFORCE), train (data -> artifact),
artifact (the file), engine (routing inside the decode loop), evaluate (replaying decisions on
measured runs) and report."""
