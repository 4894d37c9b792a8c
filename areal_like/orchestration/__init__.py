"""Orchestration: the only layer that imports both clusters (docs/design.md §4).

It wires components and drives them: the launcher, the trainer and rollout
controllers, the channels between the clusters, the run folder, the CLI, the
dashboard, audit and report. Components below it do not know it exists. Import its
modules by path (`areal_like.orchestration.launch`); nothing here is imported by
`import areal_like`.
"""
