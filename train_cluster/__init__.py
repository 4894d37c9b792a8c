"""train_cluster package."""
