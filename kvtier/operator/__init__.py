"""The kvtier operator: thin kopf handlers, pure builders of child objects, the pod
injection webhook and status aggregation."""
