"""Answers and the one writer of downstream bytes: the Responder and its heartbeats."""
