"""``load.reports``: what a run leaves and how it is read: run records, reports and plots, planned layouts, Redis round trips."""
