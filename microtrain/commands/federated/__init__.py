"""Federated fine-tuning of a split model's trainable weights on Flower.

Needs the optional extra `[federated]` (Flower and Ray); nothing here is imported
by `microtrain` itself.  settings: the run's typed settings; partition: how a
data set is split across simulated devices; wire: what travels and how it is
counted; client_app / server_app: the Flower apps; simulation: Flower's
simulation engine on this machine; deployment: the app directory `flwr run` needs.
"""
