"""weightserver/relay"""
