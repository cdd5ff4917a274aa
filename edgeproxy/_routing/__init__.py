"""Routing: which regions may answer a request, ranked into its one plan."""
