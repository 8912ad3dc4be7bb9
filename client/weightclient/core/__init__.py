"""client/weightclient/core"""
