"""One-op repros: keep what a failing or non-finite op read, and write it as a standalone script."""
