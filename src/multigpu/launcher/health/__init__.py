"""A lost device, on one machine: which devices of a launch are unhealthy when a rank dies
(device_health, with NVML's view in nvml_health), and the next attempt without them
(lost_devices, for --min-devices)."""
