"""Serving runtime: hybrid cache, scheduler, model runner, engine."""
