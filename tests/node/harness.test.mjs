// The harness itself: stopServer must fail a test when the server leaves a sanitizer report or
// exits uncleanly (what makes the ASan run of the server tests meaningful). A small Node script
// stands in for `lily serve`: it prints the startup line, and on SIGTERM the given report and
// exit status. Run: node --test tests/node/harness.test.mjs
import { after, describe, it } from 'node:test';
import assert from 'node:assert/strict';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { startServer, stopServer } from './server_harness.mjs';

const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'lily-harness-'));
after(() => fs.rmSync(dir, { recursive: true, force: true }));

/** Writes an executable stand-in that prints `report` to stderr and exits `code` on SIGTERM. */
function standIn(name, report, code) {
  const file = path.join(dir, name);
  fs.writeFileSync(file, `#!${process.execPath}
process.on('SIGTERM', () => { process.stderr.write(${JSON.stringify(report)}); process.exit(${code}); });
process.stderr.write('lily: info: serving demo on http://127.0.0.1:9 (stand-in)\\n');
setInterval(() => {}, 1000);
`, { mode: 0o755 });
  return file;
}

describe('stopServer', () => {
  it('passes a clean exit', async () => {
    const server = await startServer([], {}, { bin: standIn('clean', 'lily: info: shutting down\n', 0) });
    assert.deepEqual(await stopServer(server).then((e) => [e.code, e.signal]), [0, null]);
  });

  it('fails on an AddressSanitizer report even with exit status 0', async () => {
    const report = '=================================================================\n' +
      '==42==ERROR: AddressSanitizer: heap-use-after-free on address 0x602000000010\n';
    const server = await startServer([], {}, { bin: standIn('asan', report, 0) });
    await assert.rejects(stopServer(server), /sanitizer report from lily serve:[\s\S]*heap-use-after-free/);
  });

  it('fails on a UBSan report and on a leak report', async () => {
    const ubsan = await startServer([], {}, {
      bin: standIn('ubsan', 'src/x.cpp:3:5: runtime error: signed integer overflow\n', 0),
    });
    await assert.rejects(stopServer(ubsan), /sanitizer report/);
    const leak = await startServer([], {}, {
      bin: standIn('leak', '==7==ERROR: LeakSanitizer: detected memory leaks\n', 23),
    });
    await assert.rejects(stopServer(leak), /LeakSanitizer/);
  });

  it('fails on a non-zero exit status', async () => {
    const server = await startServer([], {}, { bin: standIn('status', 'lily: error: boom\n', 1) });
    await assert.rejects(stopServer(server), /exited with \{"code":1,"signal":null\}/);
  });
});
