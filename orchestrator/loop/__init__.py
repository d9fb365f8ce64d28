"""The round loop: the controller every mode runs, its engines (embedded, services), stop checks, the services' gRPC clients and the round metrics. Imports planning and specdec."""
