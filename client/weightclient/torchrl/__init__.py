"""client/weightclient/torchrl"""
