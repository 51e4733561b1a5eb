from services._main import run_stage
from services.draft.server import serve

run_stage("draft", serve)
