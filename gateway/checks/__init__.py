"""Checks of a submission that every part shares: the batch's fields and sizes (validation) and completion windows and priorities (windows)."""
