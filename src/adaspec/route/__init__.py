"""The context-aware draft router (Huang et al.): a policy trained offline reads the target's
prompt state from the prefill and picks the decoding method (drafter or plain decoding) for
each request. One module per job: arms, reward, data, policy, artifact, engine, collect,
evaluate."""
