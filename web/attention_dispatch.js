// Shows the attention report of each sampling run in the browser console and as a toast.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

app.registerExtension({
  name: "attention_dispatch.report",
  async setup() {
    api.addEventListener("attention_dispatch.report", (event) => {
      const report = event.detail || {};
      console.info("[attention dispatch]", report.summary || report);
      const rows = (report.recorder && report.recorder.rows) || [];
      const fell = rows.filter((r) => r.fell_back);
      if (fell.length && app.extensionManager && app.extensionManager.toast) {
        app.extensionManager.toast.add({
          severity: "warn",
          summary: "Attention backend fell back",
          detail: fell.map((r) => `${r.site}: ${r.requested} -> ${r.served} (${(r.reasons || []).join("; ")})`).join("\n"),
          life: 8000,
        });
      }
    });
  },
});
