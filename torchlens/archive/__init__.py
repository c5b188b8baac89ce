"""Saved traces: a recording as files a user can read (`save`), and back (`tl.load`)."""
