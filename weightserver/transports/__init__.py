"""weightserver/transports"""
