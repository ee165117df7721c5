"""Attention engines: one function per engine, all computing the same masks (lctrain.attention.modes)."""
