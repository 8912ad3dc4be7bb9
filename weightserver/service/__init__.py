"""weightserver/service"""
