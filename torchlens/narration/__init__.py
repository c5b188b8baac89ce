"""Text: the line grammar, the narrator that feeds it, and the sinks lines are written to."""
