"""Everything the steps import, in one module that the fork server of the multiprocess
executor loads once (`assets/executors.py`): the services, and with them torch and
transformers' processors."""

import transformers.processing_utils  # noqa: F401  (AutoProcessor's classes)

import mm_assets.services.extraction
import mm_assets.services.ingest
import mm_assets.services.measurement
import mm_assets.services.prep
import mm_assets.services.regeneration
import mm_assets.services.training  # noqa: F401
