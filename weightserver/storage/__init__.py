"""weightserver/storage"""
