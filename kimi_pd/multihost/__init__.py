"""The fleet across hosts on one machine: network namespaces on a bridge as hosts (`netns`), each
role started there with its deploy/compose/roles command (`roles`), the whole fleet (`fleet`), and a
rehearsal a user can run (`python -m kimi_pd.multihost`)."""
