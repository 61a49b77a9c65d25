"""The learner process and its parts.

The step loop, its link to the syncer, recovery, multi-host islands, warm standbys, and
`python -m decoupled_diloco.learner`.
"""
