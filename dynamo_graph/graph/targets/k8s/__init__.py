"""The Kubernetes target, render only: the graph as plain manifests running `dyngraph run`
(manifests.py) or as Dynamo's DynamoGraphDeployment (dynamo_k8s.py), what the two share
(common.py), `dyngraph import` of a DGD (dgd_import.py), and the target (target.py)."""
