"""The pass every substrate feeds: one forward's values go Pipeline -> Session -> Recording.

What a substrate (eager, compiled, backward) hands in, and the lifecycle and log of one pass."""
