"""The coordinator: registry, routing, control states and the ROUTER loop that ties them."""

from dpserve.coordinator.control import ControlState
from dpserve.coordinator.coordinator import DataParallelInferenceCoordinator
from dpserve.coordinator.routing import RoutingPolicy

__all__ = ["ControlState", "DataParallelInferenceCoordinator", "RoutingPolicy"]
