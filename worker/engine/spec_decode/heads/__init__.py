"""Learned draft heads on the target's last hidden state (EAGLE, Medusa), their storage and their training."""
