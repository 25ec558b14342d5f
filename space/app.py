"""The course's LoRA studio as a Hugging Face Space: the same app as `course studio`
(`course_lib.studio.page.build_studio`). Runs, checkpoints and exports live under $COURSE_STUDIO_ROOT (default
`studio/` beside this file; on a Space, a persistent-storage path such as /data/studio keeps them across
restarts)."""
import os
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
from course_lib.studio import build_studio

demo = build_studio(os.environ.get("COURSE_STUDIO_ROOT") or Path(__file__).parent/"studio")

if __name__ == "__main__":
    demo.launch(server_name=os.environ.get("GRADIO_SERVER_NAME", "0.0.0.0"))
