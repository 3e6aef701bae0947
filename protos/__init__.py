"""The gRPC contract (``fleetbatch.proto``) between clients, the gateway and admin tools, with its
generated Python modules. A shared contract at the bottom: it imports nothing of the project."""
