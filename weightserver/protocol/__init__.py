"""weightserver/protocol"""
