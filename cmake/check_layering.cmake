# The layering rule as a check: every #include "folder/…" or #include <folder/…> of a source under
# src/ whose first folder is a component's (src/ is a public include root, so the angled form
# compiles too) must name a component that the including component may use. Run with
#   cmake -DLILY_SRC=<dir with the component folders> -P cmake/check_layering.cmake
# It prints every include that breaks the rule (file, line, the included header, the allowed
# components) and fails if there is one. The components and what each may include:
#   base                                   only itself
#   io, model                              base (model also io)
#   text                                   base
#   backends/cpu, backends/cuda            base, io, model, and of engine only the Backend
#                                          interface (engine/backend.h, engine/sampler.h)
#   backends (the factory)                 the above and both backends
#   engine                                 base, io, model, text — no backend's internals
#   server                                 base, io, model, text, engine — no kernels
#   cli                                    everything but the backends' internals
cmake_minimum_required(VERSION 3.25)  # policies (IN_LIST) for a script run with -P
if(NOT LILY_SRC)
  message(FATAL_ERROR "check_layering: pass -DLILY_SRC=<source folder>")
endif()

get_filename_component(LILY_SRC "${LILY_SRC}" ABSOLUTE)

set(allowed_base base)
set(allowed_io base io)
set(allowed_model base io model)
set(allowed_text base text)
set(allowed_backends/cpu base io model engine backends/cpu)
set(allowed_backends/cuda base io model engine backends/cuda)
set(allowed_backends base io model engine backends backends/cpu backends/cuda)
set(allowed_engine base io model text engine)
set(allowed_server base io model text engine server)
set(allowed_cli base io model text engine server cli)

# Narrower rules within an allowed component: only_<from>_from_<to> lists the headers of `to`
# that `from` may include (none listed: every header of `to`).
set(only_backends/cpu_from_engine engine/backend.h engine/sampler.h)
set(only_backends/cuda_from_engine engine/backend.h engine/sampler.h)

# The first folders of the components' headers: an angled include under any other folder is a
# system or third-party header (<vector>, <nlohmann/json.hpp>, <sys/wait.h>) and not checked.
set(component_tops base io model text backends engine server cli)

# The component of a path relative to the source folder: its first folder, or backends/<name>.
function(component_of rel out)
  string(REGEX MATCH "^[^/]+" top "${rel}")
  if(top STREQUAL "backends" AND rel MATCHES "^backends/([^/]+)/")
    set(top "backends/${CMAKE_MATCH_1}")
  endif()
  set(${out} "${top}" PARENT_SCOPE)
endfunction()

file(GLOB_RECURSE sources RELATIVE "${LILY_SRC}" "${LILY_SRC}/*.h" "${LILY_SRC}/*.cpp" "${LILY_SRC}/*.cu" "${LILY_SRC}/*.cuh")
set(violations 0)
foreach(rel IN LISTS sources)
  component_of("${rel}" from)
  if(NOT DEFINED allowed_${from})
    message(SEND_ERROR "check_layering: ${rel}: the folder `${from}` is not a known component (add it to cmake/check_layering.cmake)")
    math(EXPR violations "${violations} + 1")
    continue()
  endif()
  file(STRINGS "${LILY_SRC}/${rel}" lines REGEX "^[ \t]*#[ \t]*include[ \t]*[\"<]")
  foreach(line IN LISTS lines)
    if(line MATCHES "include[ \t]*\"([^\"]+)\"")
      set(header "${CMAKE_MATCH_1}")
      set(written "\"${header}\"")
    elseif(line MATCHES "include[ \t]*<([^>]+)>")
      set(header "${CMAKE_MATCH_1}")
      set(written "<${header}>")
    else()
      continue()
    endif()
    if(NOT header MATCHES "^([^/]+)/")
      continue()  # a sibling header (the same component) or a system header
    endif()
    set(top "${CMAKE_MATCH_1}")
    if(written MATCHES "^<" AND NOT top IN_LIST component_tops)
      continue()  # a system or third-party header
    endif()
    component_of("${header}" to)
    if(NOT to IN_LIST allowed_${from})
      string(REPLACE ";" ", " allowed "${allowed_${from}}")
      message(SEND_ERROR "check_layering: ${rel} includes ${written}: `${from}` may include only ${allowed}")
      math(EXPR violations "${violations} + 1")
    elseif(DEFINED only_${from}_from_${to} AND NOT header IN_LIST only_${from}_from_${to})
      string(REPLACE ";" ", " only "${only_${from}_from_${to}}")
      message(SEND_ERROR "check_layering: ${rel} includes ${written}: of `${to}`, `${from}` may include only ${only}")
      math(EXPR violations "${violations} + 1")
    endif()
  endforeach()
endforeach()
list(LENGTH sources n)
if(violations GREATER 0)
  message(FATAL_ERROR "check_layering: ${violations} include(s) break the layering (${n} files read)")
endif()
message(STATUS "check_layering: ${n} files, every include within the layering")
