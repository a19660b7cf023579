"""What every entry point shares: the run lifecycle (resume, report, final upload, exit code),
services (metrics, notices, mirror), the run-dir lock and the rank context."""
