"""Detectors: one module per anomaly family, each defining
`detect(job: JobData, config: DiagnosisConfig) -> list[Anomaly]`.

The registry (`flare.diagnostics.registry`) discovers every module in this package
that defines `detect`, so a new detector is a new file and nothing else.
"""
