// scripts/demo.sh builds its request body in shell: its json_escape must turn any question
// (LILY_DEMO_QUESTION) into a valid JSON string with the same text. A question with a double
// quote used to make an invalid body, and the demo died with "curl: (22) … error: 400".
import { describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

const script = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..', '..', 'scripts', 'demo.sh');

/** json_escape(text) as defined in scripts/demo.sh, run by bash. */
function jsonEscape(text) {
  const r = spawnSync('bash', ['-c', `source <(sed -n '/^json_escape() {/,/^}/p' "$0"); json_escape "$1"`, script, text],
    { encoding: 'utf8' });
  assert.equal(r.status, 0, r.stderr);
  return r.stdout;
}

describe('scripts/demo.sh', () => {
  it('json_escape makes a JSON string of any question', () => {
    for (const q of ['What does add_executable do?', 'What does "add_executable" do?', 'a \\ b \\\\ c',
      'tab\there', 'two\nlines\n', 'cr\r\nlf', 'ünïcödé ✓ 漢字', '']) {
      assert.equal(JSON.parse(`"${jsonEscape(q)}"`), q.replace(/\n$/, ''), JSON.stringify(q));
    }
  });
});
