"""The replicas: layers, models, the loss, and one replica's flat buffers on its device."""
