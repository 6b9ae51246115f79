"""The model executor: model runner, weight loader, model implementations and their layers (torch enters here)."""
