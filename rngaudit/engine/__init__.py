"""Replaying Flax's key derivation: hashing, Threefry, the one key engine, the replay and its lifted-transform
rules, the vectorised key table, and the `derive` stage."""
