"""Mirror committed checkpoints to object storage and resume from it (DESIGN.md, 'Object
storage'). One module per job: layout, upload, download, resume, background worker."""

from runner.mirror.background import Mirror, MirrorMetrics
from runner.mirror.download import download_checkpoint
from runner.mirror.resume import resolve_resume
from runner.mirror.upload import remote_manifest, upload_checkpoint

__all__ = [
    "Mirror",
    "MirrorMetrics",
    "download_checkpoint",
    "remote_manifest",
    "resolve_resume",
    "upload_checkpoint",
]
