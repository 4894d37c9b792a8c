"""rollout_cluster package."""
