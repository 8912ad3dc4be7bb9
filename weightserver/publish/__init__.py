"""weightserver/publish"""
