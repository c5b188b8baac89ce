"""The measurement core: facts about a value's memory, its statistics, and the verdicts on it.

Policy (when and what to read) -> recipe -> kernels; text is rendered elsewhere (narration)."""
