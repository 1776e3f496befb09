"""Sizing the pools: a cost model, a fleet simulation on a trace, and the search for the cheapest fleet."""
